"""The generation config: what every layer of the compressed cache stores (``kvconfig``:
frozen, versioned, JSON dataclasses and presets) and the layout rules a config must meet
(``rules``)."""
