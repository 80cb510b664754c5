"""Launcher and cluster logic: threads per rank, launcher detection, pre-flight checks, ports."""
