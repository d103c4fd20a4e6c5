"""The command line: click commands, the flag table, `actmem plot`."""
