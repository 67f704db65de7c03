from kvsim.cli.app import entry

entry()
