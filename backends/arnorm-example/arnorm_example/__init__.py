"""arnorm-example: a third-party backend written only against ``arnorm.plugin``."""
