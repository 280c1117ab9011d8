"""GRPO math (pure): advantages, the token loss, the rollout batch."""
