"""The writers both feeds share: the run's ``stability.jsonl`` and TensorBoard events."""
