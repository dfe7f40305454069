"""Test helpers: tiny model builders and a server-subprocess runner (importable as `helpers`)."""
