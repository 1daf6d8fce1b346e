"""Files from and to the user: bounded readers, atomic writers that never replace, and signal-safe critical sections."""
