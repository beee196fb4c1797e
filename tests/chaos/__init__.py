"""The red team's scenarios replayed against real processes (see docs/hardening.md)."""
