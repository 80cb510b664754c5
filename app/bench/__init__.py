"""`python -m app.bench`: the reference DDP trainer and Lightning DDP, side by side (see `__main__`)."""
