{{/*
Cross-field checks the JSON schema cannot express well, with the fix in the message. Included once,
from the Deployment, so a bad combination fails the whole render.
*/}}
{{- define "batchgate.validate" -}}
{{- $v := .Values }}
{{- if ne (len (uniq (list (int64 $v.containerPorts.grpc) (int64 $v.containerPorts.http) (int64 $v.containerPorts.health)))) 3 }}
{{- fail "containerPorts.grpc, http and health must be three different ports" }}
{{- end }}
{{- if $v.tls.enabled }}
{{- $ports := list (int64 $v.containerPorts.grpc) (int64 $v.containerPorts.http) (int64 $v.containerPorts.metrics) (int64 $v.containerPorts.health) }}
{{- if ne (len (uniq $ports)) 4 }}
{{- fail "tls.enabled: containerPorts.grpc, http, metrics and health must be four different ports" }}
{{- end }}
{{- if eq (not $v.tls.existingSecret) (not $v.tls.certManager.enabled) }}
{{- fail "tls.enabled needs exactly one of tls.existingSecret (a kubernetes.io/tls Secret) and tls.certManager.enabled" }}
{{- end }}
{{- if and $v.tls.certManager.enabled (not $v.tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name (an Issuer or ClusterIssuer)" }}
{{- end }}
{{- end }}
{{- if and (eq $v.modelRepository.source "pvc") (not $v.modelRepository.pvc.existingClaim) }}
{{- fail "modelRepository.source=pvc needs modelRepository.pvc.existingClaim (a claim holding the Triton-layout repository)" }}
{{- end }}
{{- if and (eq $v.modelRepository.source "initContainer") (not $v.modelRepository.initContainer.image.repository) }}
{{- fail "modelRepository.source=initContainer needs modelRepository.initContainer.image.repository (an image holding the repository)" }}
{{- end }}
{{- if and $v.auth.enabled (not $v.auth.existingSecret) (not $v.auth.apiKeysFile) }}
{{- fail "auth.enabled needs auth.apiKeysFile (the file's content) or auth.existingSecret" }}
{{- end }}
{{- $r := $v.redis }}
{{- if eq $r.mode "external" }}
{{- if and $r.url $r.existingSecret }}
{{- fail "redis.url cannot be combined with redis.existingSecret: put the URL in that Secret and set redis.existingSecretUrlKey" }}
{{- end }}
{{- if not (or $r.url $r.host $r.existingSecretUrlKey) }}
{{- fail "redis.mode=external needs redis.host, redis.url, or redis.existingSecret with redis.existingSecretUrlKey" }}
{{- end }}
{{- if and $r.existingSecretUrlKey (not $r.existingSecret) }}
{{- fail "redis.existingSecretUrlKey names a key of redis.existingSecret; set redis.existingSecret too" }}
{{- end }}
{{- else if eq $r.mode "internal" }}
{{- if or $r.url $r.host $r.existingSecretUrlKey }}
{{- fail "redis.mode=internal runs its own Redis: leave redis.url, redis.host and redis.existingSecretUrlKey empty (or use mode=external)" }}
{{- end }}
{{- end }}
{{- if and $v.autoscaling.enabled (not (kindIs "invalid" $v.autoscaling.targetCPUUtilizationPercentage)) }}
{{- if not (and $v.resources.requests $v.resources.requests.cpu) }}
{{- fail "autoscaling on CPU needs resources.requests.cpu (utilisation is measured against it)" }}
{{- end }}
{{- end }}
{{- if and $v.autoscaling.enabled (kindIs "invalid" $v.autoscaling.targetCPUUtilizationPercentage) (not $v.autoscaling.metrics) }}
{{- fail "autoscaling.enabled needs targetCPUUtilizationPercentage or at least one entry in autoscaling.metrics" }}
{{- end }}
{{- if $v.podDisruptionBudget.enabled }}
{{- if eq (kindIs "invalid" $v.podDisruptionBudget.maxUnavailable) (kindIs "invalid" $v.podDisruptionBudget.minAvailable) }}
{{- fail "podDisruptionBudget: set exactly one of maxUnavailable and minAvailable (null the other)" }}
{{- end }}
{{- end }}
{{- end }}
