//! See tests/: kiln's models on plain Burn.
