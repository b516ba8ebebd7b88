"""Inspection of any model: parameters, memory, shapes and FLOPs, mask checks. Each function
takes a module and inputs (or a Subject), never tfcli's own model classes."""
