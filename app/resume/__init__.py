"""Exact and elastic resume: the data position, random state and per-rank state a checkpoint keeps, and `ddp-app
resume-check`, which proves a resume ends where the uninterrupted run does.

Imports nothing heavy: the plain-PyTorch reference imports `app.resume.elastic`."""
