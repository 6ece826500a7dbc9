"""The CSI node plugin ``csi.kvpool.io`` (``kvpool-csi``): publishes a pool's segment
directory into tenant pods as an inline ephemeral volume, so pods under Pod Security
"restricted" (no hostPath) can map the segment."""
