"""The verbs of ``megatron-kd``, one module each; ``cli.COMMANDS`` names them. A module holds only
the command: its flags, its help and its ``run``; the work is the libraries' (``teacher``,
``prune``, ``data``, ``models``, ``megatron``, ``cache``, ``demo``). Nothing below this package
imports it.

Every module has ``HELP``, its line in ``megatron-kd --help``, and ``run(...)``, which returns the
exit status. It takes its command line in one of three ways:

- ``add_arguments(parser)``: its flags join megatron-kd's own parser (argparse), which hands ``run``
  the parsed namespace (``demo``, ``hf-flags``, ``gguf-to-hf``, ``cache inspect``, ``cache verify``);
- ``check(argv)``: the rest of the command line, untouched, to the command's own parser
  (``data chat``, ``data text``: Megatron-LM's ``--tokenizer-*`` flags among theirs);
- ``check(argv)`` with ``MEGATRON = True``: the rest of the command line carries Megatron-LM's
  flags, handed over untouched (``train``, ``cache build``, ``export-hf``, ``prune``, ``plan``).
  ``add_arguments(parser)``, where the command has flags of its own, adds them (read from the same
  command line); ``--help`` lists them with ``DESCRIPTION`` and the ``--kd-*`` flags,
  ``--help-megatron`` Megatron-LM's.

``check(argv)`` finds every mistake it can before any work (one ``UserError`` each: the same on
every rank under torchrun, so rank 0 reports them) and returns what ``run`` starts from.

A module imports its libraries inside its functions: ``cli`` imports every command before it sets
up the console, and megatron-core's import notices must come after that.
"""
