; Inno Setup script for KVBoost Desktop on Windows: a per-user install (no administrator rights) of the
; PyInstaller folder, a Start menu entry, an optional desktop icon and an uninstaller.
; packaging/windows/build.ps1 compiles it after freezing:
;   ISCC.exe /DAppVersion=0.1.0 /DVariant=cpu packaging\windows\kvboost.iss
; The user's conversations, logs and caches (%LOCALAPPDATA%\KVBoost\KVBoost Desktop) are not removed on uninstall.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
; cpu: torch's CPU wheel (one setup .exe); cuda: a CUDA wheel, whose bundle is past the 2 GB one setup file holds.
#ifndef Variant
  #define Variant "cpu"
#endif
#define SourceDir "..\..\build\frozen\kvboost-desktop"
#define AppExe "kvboost-desktop.exe"

[Setup]
; Never change the AppId: Windows finds the installed copy (upgrade, uninstall) by it.
AppId={{BB405046-0A8B-4BB3-A3F4-E5166B44D31D}
AppName=KVBoost Desktop
AppVersion={#AppVersion}
AppVerName=KVBoost Desktop {#AppVersion}
AppPublisher=KVBoost Desktop developers
; Per user: installs into the user's own programs folder, never asks for administrator rights.
PrivilegesRequired=lowest
DefaultDirName={localappdata}\Programs\KVBoost Desktop
DefaultGroupName=KVBoost Desktop
DisableProgramGroupPage=yes
UsePreviousAppDir=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir=..\..\dist
OutputBaseFilename=kvboost-desktop-{#AppVersion}-windows-x64-{#Variant}-setup
SetupIconFile=..\..\resources\icons\kvboost.ico
UninstallDisplayIcon={app}\{#AppExe}
UninstallDisplayName=KVBoost Desktop
Uninstallable=yes
WizardStyle=modern
Compression=lzma2
SolidCompression=yes
#if Variant == "cuda"
; Setup files past 2 GB do not work: the CUDA build is written as setup.exe plus setup-N.bin slices beside it.
DiskSpanning=yes
DiskSliceSize=max
#endif

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[InstallDelete]
; An upgrade replaces the bundle whole: files a newer build no longer has must not linger beside it.
Type: filesandordirs; Name: "{app}\_internal"

[Icons]
Name: "{autoprograms}\KVBoost Desktop"; Filename: "{app}\{#AppExe}"
Name: "{autodesktop}\KVBoost Desktop"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,KVBoost Desktop}"; Flags: nowait postinstall skipifsilent
