"""The reference GPT's Lightning pieces: LightningModule, DataModule, fault injection, and
`run_scenario`, which trains one failure scenario."""
