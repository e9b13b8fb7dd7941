"""The command line: the one entry point and its serve and generate commands."""
