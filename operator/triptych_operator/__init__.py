"""The kopf operator that reconciles DiffusionPipeline resources into Deployments and Services."""
