//! Scenario runner (placeholder while building).
