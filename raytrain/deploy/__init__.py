"""Deploying a job: the KubeRay objects `raytrain k8s` renders and the pods' sizes. Torch-free."""
