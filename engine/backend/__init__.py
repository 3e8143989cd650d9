"""GPU backends."""
