from raytrain.cli import entry

entry()
