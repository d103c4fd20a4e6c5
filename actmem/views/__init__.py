"""Outputs only: the terminal's tables, plain records (JSON, CSV, markdown), the plots' frames and drawings."""
