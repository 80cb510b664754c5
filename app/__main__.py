"""`python -m app` is the same command as `ddp-app`."""

from app.cli import main

if __name__ == "__main__":
    main()
