"""Run configuration: `loader` is the generic typed-YAML machinery (it imports nothing
else of muajax, so any layer may define its config class with it); `schema` is the run's
`TrainConfig`, composed from the config classes that live next to the code they configure."""
