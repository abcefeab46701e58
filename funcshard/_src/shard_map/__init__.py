"""Floor 4, the transform: inputs (signature, reshard moves) -> one executor per backend -> outputs; ``compile=``,
the sim gradient path and the replica checks."""
