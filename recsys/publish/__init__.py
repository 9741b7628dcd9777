"""Publishing one date's partition: the manifest, validation, the per-date lock, the partition swap per store,
and publishing with recovery after a kill."""
