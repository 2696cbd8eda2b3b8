{{/*
Cross-field checks the JSON schema cannot express well, with the fix in the message. Included once,
from the Deployment, so a bad combination fails the whole render.
*/}}
{{- define "batchgate.validate" -}}
{{- $v := .Values }}
{{- if ne (len (uniq (list (int64 $v.containerPorts.grpc) (int64 $v.containerPorts.http) (int64 $v.containerPorts.health)))) 3 }}
{{- fail "containerPorts.grpc, http and health must be three different ports" }}
{{- end }}
{{- $ports := list (int64 $v.containerPorts.grpc) (int64 $v.containerPorts.http) (int64 $v.containerPorts.metrics) (int64 $v.containerPorts.health) }}
{{- if ne (len (uniq $ports)) 4 }}
{{- fail "containerPorts.grpc, http, metrics and health must be four different ports (metrics is always open: the liveness probe and the scrape use it)" }}
{{- end }}
{{- if $v.tls.enabled }}
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
{{- if eq $v.modelRepository.source "initContainer" }}
{{- $i := $v.modelRepository.initContainer.image }}
{{- if not $i.repository }}
{{- fail "modelRepository.source=initContainer needs modelRepository.initContainer.image.repository (an image holding the repository)" }}
{{- end }}
{{- if not (or $i.tag $i.digest) }}
{{- fail "modelRepository.initContainer.image needs a tag (a fixed version) or a digest (sha256:...): every pod must copy the same models" }}
{{- end }}
{{- if and (eq $i.tag "latest") (not $i.digest) }}
{{- fail "modelRepository.initContainer.image.tag latest is mutable (nodes keep whichever they pulled, so pods would serve different models): pin a version or set image.digest" }}
{{- end }}
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
{{- $res := ternary $v.gpu.resources $v.resources $v.gpu.enabled }}
{{- if not (and $res.requests $res.requests.cpu) }}
{{- fail (printf "autoscaling on CPU needs %s.requests.cpu (utilisation is measured against it)" (ternary "gpu.resources" "resources" $v.gpu.enabled)) }}
{{- end }}
{{- end }}
{{- if and $v.autoscaling.enabled (kindIs "invalid" $v.autoscaling.targetCPUUtilizationPercentage) (not $v.autoscaling.metrics) }}
{{- fail "autoscaling.enabled needs targetCPUUtilizationPercentage or at least one entry in autoscaling.metrics" }}
{{- end }}
{{- $ca := $r.tlsCA }}
{{- if and $ca.existingSecret $ca.existingConfigMap }}
{{- fail "redis.tlsCA: set one of existingSecret and existingConfigMap (the CA's PEM under redis.tlsCA.key), not both" }}
{{- end }}
{{- if or $ca.existingSecret $ca.existingConfigMap }}
{{- if ne $r.mode "external" }}
{{- fail "redis.tlsCA is for an external Redis over TLS (redis.mode=external); the in-chart Redis speaks plaintext inside the cluster" }}
{{- end }}
{{- if and $r.url (not (hasPrefix "rediss://" $r.url)) }}
{{- fail "redis.tlsCA needs TLS: redis.url must start with rediss://" }}
{{- end }}
{{- if and (not $r.url) (not $r.existingSecretUrlKey) (not $r.tls) }}
{{- fail "redis.tlsCA needs TLS: set redis.tls=true (the URL becomes rediss://)" }}
{{- end }}
{{- end }}
{{- $k := $v.autoscaling.keda }}
{{- if and $v.autoscaling.enabled $k.enabled }}
{{- fail "autoscaling.enabled (the CPU/metrics HPA) and autoscaling.keda.enabled (KEDA's HPA) would fight over the replica count: enable one" }}
{{- end }}
{{- if $k.enabled }}
{{- if not $k.serverAddress }}
{{- fail "autoscaling.keda.enabled needs autoscaling.keda.serverAddress (Prometheus' HTTP address as KEDA reaches it)" }}
{{- end }}
{{- if and (not $k.query) (not $v.metrics.serviceMonitor.enabled) }}
{{- fail "autoscaling.keda: the default query selects the scrape by the ServiceMonitor's labels; set metrics.serviceMonitor.enabled=true, or write autoscaling.keda.query for your own scrape" }}
{{- end }}
{{- end }}
{{- if gt (int64 $v.autoscaling.minReplicas) (int64 $v.autoscaling.maxReplicas) }}
{{- if or $v.autoscaling.enabled $k.enabled }}
{{- fail "autoscaling.minReplicas is above autoscaling.maxReplicas" }}
{{- end }}
{{- end }}
{{- if $v.topologySpread.enabled }}
{{- range $v.topologySpreadConstraints }}
{{- if and (eq .topologyKey $v.topologySpread.topologyKey) (eq (.whenUnsatisfiable | default "DoNotSchedule") $v.topologySpread.whenUnsatisfiable) }}
{{- fail (printf "topologySpreadConstraints repeats topologySpread's %s/%s (Kubernetes refuses the pair): drop it, or set topologySpread.enabled=false" .topologyKey $v.topologySpread.whenUnsatisfiable) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $v.podDisruptionBudget.enabled }}
{{- if eq (kindIs "invalid" $v.podDisruptionBudget.maxUnavailable) (kindIs "invalid" $v.podDisruptionBudget.minAvailable) }}
{{- fail "podDisruptionBudget: set exactly one of maxUnavailable and minAvailable (null the other)" }}
{{- end }}
{{- end }}
{{- end }}
