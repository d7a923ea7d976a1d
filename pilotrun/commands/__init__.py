"""The commands: thin calls into the folders below (cli, api, pilot, freeze, export, inspect-batch)."""
