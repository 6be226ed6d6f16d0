"""hascheduler's development tools: the MongoDB-wire compatible development server
(devmongo/) and the local cluster (devcluster/). Never in the production image; the
``hascheduler`` command finds their commands by entry point (commands/)."""
