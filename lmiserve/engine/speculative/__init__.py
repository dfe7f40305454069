"""Speculative decoding: when rows draft (`SpeculationPolicy`) and who proposes the drafts (`proposers`:
prompt lookup, a draft model)."""
