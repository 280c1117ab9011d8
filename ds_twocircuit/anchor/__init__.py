"""The anchor circuit's math: sign(M) bit packing, the sign correction, the staleness contract."""
