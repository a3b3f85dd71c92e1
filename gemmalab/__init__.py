"""gemmalab."""
