"""Floor 4: the ``Array`` type, ``device_put`` / ``device_get`` / ``reshard`` and the reshard moves, ``visualize``,
and the DTensor hand-off."""
