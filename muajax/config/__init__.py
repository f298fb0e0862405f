"""The run's configuration: `schema` assembles `TrainConfig` from the config classes that
live next to the code they configure (built with `muajax.settings`), and `reference`
writes every key of it, with its type, default and one line, to docs/config.md."""
