"""The server's options: one table from command-line flag and ``VLM_*`` variable to field.

Map:
  table         `ServerConfig`: every option with its default, group and help (the table),
                its checks, and the configurations of the components it feeds (EngineConfig,
                ImageLimits, ConstraintLimits) under the same field names
  spec          what an option is: `option`, `Option`, the ``--help`` groups, value parsers
  command_line  flags and environment -> `ServerConfig`; the grouped ``--help``
  markdown      docs/configuration.md (``python -m vlm_server.options --markdown``)
"""
