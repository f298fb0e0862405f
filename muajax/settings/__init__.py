"""Typed settings, the lowest rung: `fields` (checked dataclasses built from YAML mappings),
`loader` (YAML files, overrides, merging) and `secrets` (what must never be logged). They
import nothing else of muajax, so any layer may define its config class with them; the
run's schema that assembles those classes is `muajax.config.schema`."""
