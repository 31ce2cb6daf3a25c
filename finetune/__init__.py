"""Fine-tuning from pretraining checkpoints (head swap, datasets, the Accelerate loop)."""
