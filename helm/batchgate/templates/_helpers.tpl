{{/* Names and labels. */}}
{{- define "batchgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Leaves room for the "-headless" / "-redis" suffixes within the 63-character DNS label limit. */}}
{{- define "batchgate.shortname" -}}
{{- include "batchgate.fullname" . | trunc 54 | trimSuffix "-" }}
{{- end }}

{{- define "batchgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchgate.labels" -}}
helm.sh/chart: {{ include "batchgate.chart" . }}
app.kubernetes.io/name: {{ include "batchgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchgate
{{- end }}

{{/* The component label keeps the gateway's selectors from ever matching the in-chart Redis pod. */}}
{{- define "batchgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "batchgate.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "batchgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batchgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The model-copy init image: by digest when given, else by its (required, never latest) tag. */}}
{{- define "batchgate.modelImage" -}}
{{- $i := .Values.modelRepository.initContainer.image }}
{{- if $i.digest }}
{{- printf "%s@%s" $i.repository $i.digest }}
{{- else }}
{{- printf "%s:%s" $i.repository $i.tag }}
{{- end }}
{{- end }}

{{- define "batchgate.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "-cuda" "" .Values.gpu.enabled)) }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "batchgate.redis.host" -}}
{{- printf "%s-redis" (include "batchgate.shortname" .) }}
{{- end }}

{{/*
A settings value as an env string. Values pass through JSON, so every number arrives as a float64
and would print as 6.7108864e+07; whole numbers are printed as integers so pydantic can parse them.
*/}}
{{- define "batchgate.envValue" -}}
{{- if kindIs "float64" . }}
{{- if eq . (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* Seconds rounded up to a whole number (the drain settings accept fractions). */}}
{{- define "batchgate.ceil" -}}
{{- int64 (ceil .) }}
{{- end }}

{{/*
The smallest grace period that lets the drain finish: the preStop sleep, then drain_timeout_s for
queued work, drain_linger_s of UNAVAILABLE answers, the gRPC server's 2 s stop grace, and 5 s
for closing the workers. Past it the kubelet sends SIGKILL and in-flight calls are lost.
*/}}
{{- define "batchgate.minGracePeriod" -}}
{{- $d := .Values.drain }}
{{- add (int64 $d.preStopSleepSeconds) (include "batchgate.ceil" $d.timeoutSeconds) (include "batchgate.ceil" $d.lingerSeconds) 2 5 }}
{{- end }}

{{- define "batchgate.gracePeriod" -}}
{{- $min := include "batchgate.minGracePeriod" . | int64 }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- $min }}
{{- else }}
{{- $set := .Values.terminationGracePeriodSeconds | int64 }}
{{- if lt $set $min }}
{{- fail (printf "terminationGracePeriodSeconds=%d is shorter than the drain needs (%d = drain.preStopSleepSeconds + drain.timeoutSeconds + drain.lingerSeconds + 7); raise it or leave it null" $set $min) }}
{{- end }}
{{- $set }}
{{- end }}
{{- end }}

{{/* The chart's own Secret exists only when it has something to hold. */}}
{{- define "batchgate.secret.apiKeys" -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) }}true{{ end }}
{{- end }}

{{- define "batchgate.secret.redisUrl" -}}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.existingSecret) .Values.redis.url }}true{{ end }}
{{- end }}

{{- define "batchgate.secret.redisPassword" -}}
{{- $r := .Values.redis }}
{{- if and (eq $r.mode "internal") (not $r.existingSecret) }}true
{{- else if and (eq $r.mode "external") (not $r.existingSecret) (not $r.url) $r.password }}true
{{- end }}
{{- end }}

{{- define "batchgate.secretName" -}}
{{- include "batchgate.fullname" . }}
{{- end }}

{{/* Where the Redis password comes from: the user's Secret or the chart's. Empty when there is none. */}}
{{- define "batchgate.redis.passwordSecret" -}}
{{- $r := .Values.redis }}
{{- if and $r.existingSecret (not $r.existingSecretUrlKey) }}{{ $r.existingSecret }}
{{- else if include "batchgate.secret.redisPassword" . }}{{ include "batchgate.secretName" . }}
{{- end }}
{{- end }}

{{- define "batchgate.redis.passwordKey" -}}
{{- if .Values.redis.existingSecret }}{{ .Values.redis.existingSecretPasswordKey }}{{ else }}redis-password{{ end }}
{{- end }}

{{/*
The Redis password for the chart's Secret: the given one; else, for the in-chart Redis, the one
already stored (so an upgrade does not rotate it under running pods) or a new random one.
*/}}
{{- define "batchgate.redis.password" -}}
{{- if .Values.redis.password }}
{{- .Values.redis.password }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "batchgate.secretName" .) }}
{{- if and $existing $existing.data (hasKey $existing.data "redis-password") }}
{{- index $existing.data "redis-password" | b64dec }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}
{{- end }}

{{- define "batchgate.authMountDir" -}}/etc/batchgate/auth{{- end }}
{{- define "batchgate.engineCacheDir" -}}/var/cache/batchgate{{- end }}

{{/* Container security context, shared by the gateway and the model-copy init container. */}}
{{- define "batchgate.containerSecurityContext" -}}
{{- toYaml .Values.securityContext }}
{{- end }}

{{/* Resources: gpu.resources with the GPU count added to the limits when gpu.enabled, else resources. */}}
{{- define "batchgate.resources" -}}
{{- $res := deepCopy (ternary .Values.gpu.resources .Values.resources .Values.gpu.enabled) }}
{{- if .Values.gpu.enabled }}
{{- $limits := deepCopy (default (dict) $res.limits) }}
{{- $_ := set $limits .Values.gpu.resourceName (int64 .Values.gpu.count) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* TLS: where the certificate Secret is mounted (a directory, never subPath, so renewals reach the pod). */}}
{{- define "batchgate.tlsMountDir" -}}
/etc/batchgate/tls
{{- end }}

{{- define "batchgate.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "batchgate.fullname" .)) }}
{{- end }}

{{/* The port the probes ask: the plaintext health port while the service ports speak TLS. */}}
{{- define "batchgate.probePort" -}}
{{- .Values.containerPorts.health | int64 }}
{{- end }}

{{/* External Redis TLS with a private CA: the mounted PEM, named in the URL as ssl_ca_certs. */}}
{{- define "batchgate.redis.caEnabled" -}}
{{- $ca := .Values.redis.tlsCA }}
{{- if and (eq .Values.redis.mode "external") (or $ca.existingSecret $ca.existingConfigMap) }}true{{ end }}
{{- end }}

{{- define "batchgate.redis.caMountDir" -}}/etc/batchgate/redis-ca{{- end }}

{{/* The URL query that points redis-py at the CA; empty without one. */}}
{{- define "batchgate.redis.caQuery" -}}
{{- if include "batchgate.redis.caEnabled" . }}
{{- printf "ssl_ca_certs=%s/%s" (include "batchgate.redis.caMountDir" .) .Values.redis.tlsCA.key }}
{{- end }}
{{- end }}

{{/* A URL with the CA query appended, unless the URL already names one. */}}
{{- define "batchgate.redis.withCa" -}}
{{- $q := include "batchgate.redis.caQuery" .ctx }}
{{- if and $q (not (contains "ssl_ca_certs=" .url)) }}
{{- printf "%s%s%s" .url (ternary "&" "?" (contains "?" .url)) $q }}
{{- else }}
{{- .url }}
{{- end }}
{{- end }}
