"""A ddp-app run, from the parsed config to the end-of-fit summary: the config checks, the run directory, the callbacks
ddp-app installs, the coordinator of exchanges between ranks, the console."""
