"""The CSI node plugin ``csi.kvpool.io`` (``kvpool-csi``): publishes a pool's segment
directory into tenant pods as an inline ephemeral volume, so pods under Pod Security
"restricted" (no hostPath) can map the segment.

Public surface: the ``kvpool-csi`` command and the CSI node service; every module here is
the plugin's own (docs/architecture.md, "Public surfaces")."""
