"""The process mesh and everything that crosses ranks: mesh coordinates, every collective (comm.py), rank agreement, failure handling, local rank spawning."""
