"""Draft and target workers: the two model roles as processes (Ray actors) that the gateway drives."""
