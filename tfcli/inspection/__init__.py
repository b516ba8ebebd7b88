"""Inspection of any model: parameters, memory (and whether it fits a device), shapes and FLOPs,
mask checks. Each function takes a module and inputs (or a Subject), never tfcli's own model
classes."""
