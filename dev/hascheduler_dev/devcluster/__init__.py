"""The local cluster (`hascheduler dev`): supervisor, control client and stream audit."""
