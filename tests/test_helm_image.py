"""The image the Helm chart runs: one image on every gateway, Job and Ray pod (and Ray resources that pin workers to
it), built by deploy/Dockerfile as the README installs tandem, on a pinned CUDA build."""

from __future__ import annotations

import re
import tomllib

import yaml

from helm_harness import (
    CHART,
    ROOT,
    ci_values_fixture,  # noqa: F401 (the ci_values fixture)
    env_of,
    find,
    gateway_container,
    gateways,
    image_resource,
    pools_container,
    ray_groups,
    render,
)


def test_gateways_job_and_ray_pods_carry_one_image(ci_values):
    objs = render(ci_values)
    images = set()
    for deployment in gateways(objs):
        gateway = gateway_container(deployment)
        images |= {gateway["image"], env_of(gateway)["TANDEM_IMAGE"]}
    for group in ray_groups(objs).values():
        ray = group["template"]["spec"]["containers"][0]
        images |= {ray["image"], env_of(ray)["TANDEM_IMAGE"]}
    if find(objs, "Job"):
        pools = pools_container(objs)
        images |= {pools["image"], env_of(pools)["TANDEM_IMAGE"]}
    assert len(images) == 1, images
    assert image_resource(objs) == image_resource(render(ci_values))  # deterministic
    tagged = render(ci_values, "image.tag=9.9.9")
    assert image_resource(tagged) != image_resource(objs), "a new image must pin workers to new pods"


def test_image_build_follows_the_readme_install():
    readme = (ROOT / "README.md").read_text()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    torch = re.search(r"pip install torch==([\w.]+)", readme).group(1)
    assert f"ARG TORCH_VERSION={torch}\n" in dockerfile
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    # The base install is the client: the image's dependencies are the server extra's, locked (test_deploy_lock.py).
    assert "pip install --no-cache-dir --no-deps --no-build-isolation ." in dockerfile
    assert "--extra server" in (ROOT / "scripts" / "lock_deps.sh").read_text()
    assert 'ENTRYPOINT ["tandem"]' in dockerfile
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (chart["apiVersion"], chart["name"]) == ("v2", "tandem")
    assert chart["appVersion"] == project["version"], "the chart's default image tag is the package version"


def test_image_pins_a_cuda_build_and_names_the_driver_it_needs():
    from tandem.core.device import MIN_DRIVER

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    docs = (ROOT / "deploy" / "README.md").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", dockerfile, re.M))
    assert args["TORCH_VARIANT"] == "cu130"
    assert '"${TORCH_VERSION}+${TORCH_VARIANT}"' in dockerfile  # the build checks torch.__version__: PyPI's is +cu130
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in dockerfile
    # The driver minimums the docs state are the ones a failing --device cuda reports (core/device.py).
    for text in (dockerfile, docs):
        assert f"CUDA 13.0, NVIDIA driver >= {MIN_DRIVER['13']}" in text or f"| 13.0 | >= {MIN_DRIVER['13']}" in text
        assert f">= {MIN_DRIVER['12']}" in text
