"""One module per `megatron-ext` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""
