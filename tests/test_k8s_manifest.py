"""launch/k8s/jdp.yaml: the Indexed Job and headless Service are wired together.

No cluster needed: these read the manifest and check that every pod can find
the coordinator and knows its own process id and the process count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from jdp.runtime import exit_codes

MANIFEST = Path(__file__).resolve().parents[1] / "launch" / "k8s" / "jdp.yaml"
# Where Kubernetes publishes an Indexed Job pod's index (annotation, label since 1.28, env var).
COMPLETION_INDEX_FIELDS = {
    "metadata.annotations['batch.kubernetes.io/job-completion-index']",
    "metadata.labels['batch.kubernetes.io/job-completion-index']",
}


def _only(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (document,) = [d for d in documents if d and d.get("kind") == kind]
    return document


@pytest.fixture(scope="module")
def documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


@pytest.fixture(scope="module")
def job(documents) -> dict[str, Any]:
    return _only(documents, "Job")


@pytest.fixture(scope="module")
def service(documents) -> dict[str, Any]:
    return _only(documents, "Service")


@pytest.fixture(scope="module")
def container(job) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def env(container) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in container["env"]}


def test_job_is_indexed(job):
    assert job["spec"]["completionMode"] == "Indexed"


def test_container_runs_jdp_main_with_config_and_workdir(container):
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[:3] == ["python", "-m", "jdp.main"]
    assert any(arg.startswith("--config=") for arg in argv[3:])
    assert any(arg.startswith("--workdir=") for arg in argv[3:])


def test_process_count_equals_parallelism_and_completions(job, env):
    num_processes = int(env["JDP_NUM_PROCESSES"]["value"])
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == num_processes


def test_process_id_is_the_completion_index(env):
    variable = env["JDP_PROCESS_ID"]
    if "value" in variable:
        assert variable["value"] == "$(JOB_COMPLETION_INDEX)"
    else:
        assert variable["valueFrom"]["fieldRef"]["fieldPath"] in COMPLETION_INDEX_FIELDS


def test_coordinator_is_the_index_0_pod_on_the_service_port(job, service, container, env):
    host, port = env["JDP_COORDINATOR_ADDRESS"]["value"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    (service_port,) = service["spec"]["ports"]
    assert int(port) == service_port["port"]
    assert int(port) in [p["containerPort"] for p in container.get("ports", [])]


def test_service_is_headless_and_selects_the_job_pods(job, service):
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= pod_labels.items()


def test_coordinator_name_resolves_before_pods_are_ready(service):
    # Pods start without readiness; without this the DNS name may not exist yet.
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_pods_live_under_the_service_subdomain(job, service):
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]


def _exit_code_actions(job: dict[str, Any], container_name: str) -> dict[int, str]:
    """Each exit code named by a podFailurePolicy rule, mapped to the first rule's action.

    Kubernetes applies the first rule that matches; rules naming another
    container never match jdp's exit.
    """
    actions: dict[int, str] = {}
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        on_exit_codes = rule.get("onExitCodes")
        if on_exit_codes is None:
            continue
        assert on_exit_codes["operator"] == "In"
        if on_exit_codes.get("containerName", container_name) != container_name:
            continue
        for code in on_exit_codes["values"]:
            actions.setdefault(code, rule["action"])
    return actions


def test_failures_that_would_repeat_fail_the_whole_job(job, container):
    actions = _exit_code_actions(job, container["name"])
    for status in (exit_codes.FAILED, *exit_codes.PERMANENT):
        assert actions.get(status) == "FailJob", (status, actions)


def test_a_lost_peer_or_preemption_recreates_the_pod_without_counting(job, container):
    actions = _exit_code_actions(job, container["name"])
    for status in exit_codes.RESTARTABLE:
        assert actions.get(status) == "Ignore", (status, actions)


def test_rules_name_the_jdp_container(job, container):
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == container["name"]


def test_a_disrupted_pod_is_recreated_without_counting_whatever_its_exit_code(job):
    # Eviction, preemption or a drain comes first: it is the cause, the exit code follows.
    (first_rule, *_) = job["spec"]["podFailurePolicy"]["rules"]
    assert first_rule["action"] == "Ignore"
    assert first_rule["onPodConditions"] == [{"type": "DisruptionTarget"}]


def test_other_pod_failures_are_retried(job):
    # A crash or an OOM kill of one pod: recreate it; the others rejoin through exit 75.
    assert job["spec"]["backoffLimit"] > 0
    # podFailurePolicy works only with it.
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
