"""Scripted swarms on one machine: a spec (TOML), a runner of real node processes, and a report with plots."""

from swarmtrain.scenarios.spec import Event, NodeSpec, Repeat, Scenario, ScenarioError, load_spec, parse_spec

__all__ = ["Event", "NodeSpec", "Repeat", "Scenario", "ScenarioError", "load_spec", "parse_spec"]
