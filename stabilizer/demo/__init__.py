"""The reference decoder-only GPT (model, config), its corpus (data) and the failure scenarios."""
