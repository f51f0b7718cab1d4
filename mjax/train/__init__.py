"""Training: optimizer and schedules, train state, the jitted step, FLOPs/MFU metrics, and the loop."""
