"""The ``csbp`` command line: :func:`csbp.cli.main.main` and one module per subcommand group."""
