"""Hosts of the step beside Lightning's: a plain PyTorch loop or Fabric (`loop`), the Hugging
Face ``Trainer`` (`hf`, with the optional extra ``stabilizer-lightning[hf]``)."""
