"""One-off investigations whose finding is recorded (README.md), kept runnable to re-check it."""
