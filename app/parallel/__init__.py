"""How the model is spread over the ranks: the strategy resolved once (`strategy.py`), FSDP2 (`fsdp.py`) and DDP's
gradient compression (`compression.py`)."""
